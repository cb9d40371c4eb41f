"""`python -m helixtok.cli`: the helixtok command, with entry.py's guard while it imports."""

from .entry import main

main()
