from lmstool.cli import main

raise SystemExit(main())
