"""Stage 1 of dflash: chat dataset -> chat tokens + loss masks -> packed rows -> frozen target -> cache shards.

extract.data: loading and tokenising chat datasets; extract.pack: best-fit packing into fixed-length rows.
"""
