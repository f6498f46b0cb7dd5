from redisdask.cli import main

raise SystemExit(main())
