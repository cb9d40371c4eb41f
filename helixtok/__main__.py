"""`python -m helixtok`: the helixtok command (entry.py's guard included)."""

from .cli.entry import main

main()
