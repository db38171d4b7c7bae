"""What a user asked for: each command's options, declared once (commands.py), and their resolution from the
command line, a --config file and the defaults into checked, parsed values (resolve.py)."""
