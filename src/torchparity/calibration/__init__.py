"""The study that derives the tolerance constants (``torchparity calibrate``).

:mod:`.problems` draws random attention blocks and plants bugs, :mod:`.study` measures false
alarms and detection over many draws, :mod:`.report` renders ``docs/tolerance.md``;
:mod:`.draws` repeats one comparison over seeded draws for any candidate. :mod:`.training`
measures a user's model's noise band (the model in :mod:`.training_models`, the section in
:mod:`.training_report`, the rates' bounds in :mod:`.rates`).
"""
