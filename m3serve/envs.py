"""Debug switches read from the environment, all in one place."""
import os

# Force the PyTorch reference ops even on a GPU (to bisect a kernel problem).
FORCE_REFERENCE_OPS = os.environ.get("M3SERVE_FORCE_REFERENCE_OPS", "0") == "1"
