"""`python -m glance_export`: the glance-export command, also as torchrun starts it (`torchrun -m glance_export`)."""
from .cli import main

raise SystemExit(main())
