"""The command's exit codes besides 0."""

BAD_INPUT = 2  # bad input: a file, an option, a program the command cannot take
BUDGET_NOT_MET = 3  # --max-rel-error could not be met
