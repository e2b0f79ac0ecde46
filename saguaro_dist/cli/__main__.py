"""`python -m saguaro_dist.cli` == `saguaro`."""
import sys

from saguaro_dist.cli import main

sys.exit(main())
