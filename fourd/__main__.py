from fourd.cli import main

raise SystemExit(main())
