import sys

from rayfleet.cli import main

sys.exit(main())
