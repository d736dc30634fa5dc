"""The tracer side: record what one rank executes in its training step
(``record``, ``rank``), trace every rank of a mesh (``ranks``), build the
single-device and parallel plans from the lowered traces (``build``) and
check a lowering against PyTorch (``check``, ``loaded``); with what they
need: the user's mesh, pipelining, routing, constant collectives and the
memory the recorder never saw allocated (docs/torch-backend.md, "Modules")."""
