"""`python -m helixtok`: the helixtok command (entry.py's guard included)."""

from .entry import main

main()
