import sys

from fx16.cli import main

sys.exit(main())
