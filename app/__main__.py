from app.train import main

raise SystemExit(main())
