"""The CLI's commands, one module each; cli.py parses the arguments and dispatches here."""
