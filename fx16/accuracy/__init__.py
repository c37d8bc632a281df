"""The accuracy budget: the search that returns ops to fp32 until the budget holds,
and its metrics."""
