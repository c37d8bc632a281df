"""The plan: which precision each op gets and why, decided before anything is rewritten."""
