"""Resuming with the model: a trainer killed after its checkpoint trains every group exactly once across runs."""

import json
import subprocess
import sys

from streams.tq import TRAIN, ray_address
from tests.integration.trainer.staging import finalize_groups


def _run(phase: str, kafka, names, unique, tmp_path, **extra) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tests.integration.trainer.resume_trainer", phase]
    cmd += ["--bootstrap-servers", kafka.bootstrap_servers, "--prefix", names.prefix]
    cmd += ["--consumer-group", f"rs-{unique}", "--ray-address", ray_address()]
    cmd += ["--checkpoint", str(tmp_path / "ckpt.json"), "--journal", str(tmp_path / "journal.jsonl")]
    for k, v in extra.items():
        cmd += [f"--{k}", str(v)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_a_trainer_killed_after_its_checkpoint_trains_every_group_once_across_the_two_runs(
    kafka, tq_store, tq_session, unique, tmp_path
):
    names, finalized = finalize_groups(kafka, tq_store, f"rs-{unique}", versions=range(3), per_version=4)
    first = _run("first", kafka, names, unique, tmp_path, before=2, mid=1, after=2)
    assert first.returncode == -9, first.stderr[-2000:]
    journal = [json.loads(line) for line in (tmp_path / "journal.jsonl").read_text().splitlines()]
    trained = {
        kind: [g for e in journal if e["kind"] == kind for g in e["groups"]] for kind in ("before", "mid", "after")
    }
    before, mid, after = trained["before"], trained["mid"], trained["after"]
    assert before and mid and after
    rows = lambda groups: [s for g in groups for s in finalized[g].sample_ids]  # noqa: E731
    # Acked after the last checkpoint: the model that trained them is lost, so their rows must stay;
    # so must those of the checkpoint saved but never declared durable.
    assert set(tq_store.present(TRAIN, rows(mid + after))) == set(rows(mid + after))
    # Covered by the durable checkpoint: cleared.
    assert not tq_store.present(TRAIN, rows(before))

    second = _run("resume", kafka, names, unique, tmp_path, total=len(finalized))
    assert second.returncode == 0, second.stderr[-2000:]
    model = json.loads(second.stdout.strip().splitlines()[-1])["model"]
    assert sorted(model) == sorted(finalized), "every group trained once across the two runs"
    resumed = model[len(before) + len(mid) :]
    assert set(after) <= set(resumed), "the groups trained after the checkpoint were trained again"
    assert not set(mid) & set(resumed), "the checkpoint restored from holds them"
    # The final checkpoint covers everything, the groups of the checkpoint that never became durable
    # included: no row is left behind.
    assert not tq_store.present(TRAIN, [s for g in finalized.values() for s in g.sample_ids])
