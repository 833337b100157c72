from deepinfer.bench.cli import main

raise SystemExit(main())
