"""The study that derives the tolerance constants (``torchparity calibrate``): ``.problems``
and ``.models`` draw, ``.study`` measures false alarms and detection, ``.report`` writes
docs/tolerance.md, ``.draws`` repeats one comparison, ``.training`` measures a user model's
noise band."""
