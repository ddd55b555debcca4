"""`python -m m3serve` = the `m3serve` command."""
import sys

from m3serve.cli import main

sys.exit(main())
