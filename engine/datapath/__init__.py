"""The data path: how a round's bytes leave a sender and land on a receiver.

How this works: ``compiled`` turns a plan's routing table, once, into per-connection tables that a
round replays in a few host calls (the rows that need no work on the sender); ``pipeline`` runs a
round: the replay, plus a stage -> write -> complete pipeline for the other rows, under a byte budget,
with delivery proofs; ``staging`` prepares those rows (views, transforms, staging copies); ``registry``
caches the receiver's memory registrations; ``checksums`` and ``tensors`` are the byte-level helpers;
``aio`` holds the asyncio building blocks (bounded channels, byte budget, structured gather).
docs/TRANSPORTS.md ("Compiled rounds") has the details.
"""
