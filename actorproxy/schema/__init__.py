"""The typed edge's floor: the one cattrs converter, the records' wire form, JSON body loading, prefix tables.

``schema.jsonio`` reads and writes JSON bytes (orjson, with the edge's limits); ``schema.converter`` is the
one cattrs converter that structures bodies into attrs classes and unstructures records (``schema.records``
holds the records' hooks); ``schema.prefixes`` is the bounded table of byte prefixes the memos and the
engines' id encoders share. Nothing here does I/O or knows a protocol.
"""
