import sys

from hybridmoe.cli import main

sys.exit(main())
