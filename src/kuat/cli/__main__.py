import sys

from kuat.cli import main

sys.exit(main())
