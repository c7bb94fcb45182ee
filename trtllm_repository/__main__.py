import sys

from .generator import main

sys.exit(main())
