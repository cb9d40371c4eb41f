"""The command line's commands, grouped by what they read (cli.py puts them under `helixtok`)."""
