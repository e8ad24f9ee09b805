"""Search space, search, the Plan and its JSON form, explanations and baselines."""
