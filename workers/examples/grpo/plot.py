"""The run's figure: mean reward, staleness and throughput per trainer step, as a PNG (matplotlib, Agg)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from workers.examples.grpo.train import StepStats


def write_png(
    steps: Sequence[StepStats],
    path: Path,
    *,
    untrained: float,
    final: float,
    title: str = "",
    restarts: Sequence[int] = (),
) -> Path:
    """Three panels over trainer steps; the evaluated untrained and final rewards as dashed lines, and a
    red line where the run was killed whole and restarted from its checkpoint."""
    import matplotlib

    matplotlib.use("Agg")  # no display: the run may be on a headless machine
    import matplotlib.pyplot as plt

    x = [s.step for s in steps]
    fig, (ax_r, ax_s, ax_t) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    ax_r.plot(x, [s.mean_reward for s in steps], label="batch mean reward")
    ax_r.axhline(untrained, color="grey", ls="--", label=f"untrained policy (eval) {untrained:.3f}")
    ax_r.axhline(final, color="green", ls="--", label=f"final policy (eval) {final:.3f}")
    ax_r.set_ylabel("reward")
    ax_r.set_ylim(0, 1)
    ax_r.legend(loc="upper left", fontsize=8)
    ax_s.plot(x, [s.mean_staleness for s in steps], label="mean")
    ax_s.plot(x, [s.max_staleness for s in steps], ls=":", label="max")
    ax_s.set_ylabel("staleness (versions)")
    ax_s.legend(loc="upper left", fontsize=8)
    ax_t.plot(x, [s.groups_per_s for s in steps])
    ax_t.set_ylabel("groups/s trained")
    for i, step in enumerate(restarts):
        for ax in (ax_r, ax_s, ax_t):
            ax.axvline(step - 0.5, color="red", lw=1, label="job killed, restarted from checkpoint" if i == 0 else None)
    if restarts:
        ax_r.legend(loc="upper left", fontsize=8)
    ax_t.set_xlabel("trainer step (= weight version)")
    fig.suptitle(title or "GRPO through rlstream")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
