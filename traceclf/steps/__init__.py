"""Training steps of one rank and its steady-state window (:mod:`.find`), and which steady steps
a long capture is analysed on (:mod:`.plan`)."""
