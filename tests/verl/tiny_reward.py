"""verl's custom reward function for the tiny sums (loaded by path in verl's reward loop workers)."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    return 1.0 if ground_truth in solution_str.split() else 0.0
