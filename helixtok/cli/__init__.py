"""The helixtok command: a thin click layer over the library (results on stdout, progress on stderr).
Imports anything; nothing imports it.  `main` (the click group, app.py) is imported when asked for:
the console script's entry.py guards Ctrl-C before the command line's imports run."""


def __getattr__(name):
    if name == "main":
        from .app import main

        return main
    raise AttributeError(name)
