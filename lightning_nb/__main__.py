import sys

from lightning_nb.cli import main

sys.exit(main())
