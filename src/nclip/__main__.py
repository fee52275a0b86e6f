from nclip.cli import main

raise SystemExit(main())
