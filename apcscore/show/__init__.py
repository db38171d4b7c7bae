"""`apcscore show`: one record of a result file in the terminal (command.py). Kept empty so `apcscore --help`
stays fast."""
