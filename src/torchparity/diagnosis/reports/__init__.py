"""What a diagnosis shows: the terminal table and JSON (diagnosis), its settings, notes and
timings (meta), the HTML page (html), tables whose module names are never cut (columns) and
which rows of a deep model the terminal shows (folding)."""
