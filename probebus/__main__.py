import sys

from probebus.cli import main

sys.exit(main())
