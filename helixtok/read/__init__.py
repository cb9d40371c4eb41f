"""The training side: a built dataset as a torch Dataset (local or in object storage through a node's
block cache), its samplers, document masks, mixtures and schedules, and the step arithmetic.
Imports format only: a training node needs none of the build's machinery."""


def require_torch():
    """Import torch, or say which extra brings it: building and stats need no torch."""
    try:
        import torch
    except ImportError:
        raise ImportError("helixtok's torch datasets need PyTorch: pip install 'helixtok[torch]' "
                          "(or install torch yourself first, e.g. a CPU build)") from None
    return torch
