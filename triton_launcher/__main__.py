import sys

from .cli import serve_main

sys.exit(serve_main())
