import sys

from soap.cli import main

sys.exit(main())
