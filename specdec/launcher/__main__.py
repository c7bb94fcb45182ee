import sys

from specdec.launcher.serve import serve_main

sys.exit(serve_main())
