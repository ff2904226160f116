from router.check.cli import main

raise SystemExit(main())
