"""transformers' `minimax_m3_vl` image and video processors for reference tests.

They need torchvision. A torchvision wheel built for another torch (a CUDA build next to the CPU
torch) fails at import while registering its compiled operators, which these processors never
use; that registration is skipped here. Without torchvision the tests that need it skip.
"""
from unittest import mock

import pytest
import torch


def import_torchvision():
    try:
        import torchvision  # noqa: F401
        return
    except ImportError:
        pytest.skip("the transformers processors need torchvision")
    except RuntimeError:
        import sys
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
    with mock.patch.object(torch.library, "register_fake", lambda *a, **k: (lambda f: f)):
        import torchvision  # noqa: F401


def hf_processors():
    """(image processor, video processor) of transformers 5.23."""
    import_torchvision()
    from transformers.models.minimax_m3_vl.image_processing_minimax_m3_vl import MiniMaxM3VLImageProcessor
    from transformers.models.minimax_m3_vl.video_processing_minimax_m3_vl import MiniMaxM3VLVideoProcessor
    return MiniMaxM3VLImageProcessor(), MiniMaxM3VLVideoProcessor()
