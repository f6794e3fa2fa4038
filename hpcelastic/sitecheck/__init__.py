"""``hpcelastic sites check``: a site file against the live cluster it describes (:mod:`.rules` over
:mod:`.facts`) and, with ``--probe``, against what only its nodes can tell (:mod:`.probe`, :mod:`.node`)."""
