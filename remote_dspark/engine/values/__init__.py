"""The round's values, as arrays: what a round takes and what it gives.

batch        Batch: a round's entries as the engine holds them
meta         the round metadata's rules, and its host writer (host_meta, write_meta)
announce     what each slot has still to announce, and each round's part of it
device_announce  the same rule on the device: a launch()'s rounds planned in stream order
drafts       Drafts: the engine's answer to a round, one copy per array
reply        the sync path's check of a worker's DRAFTS against what was asked
slot_views   numpy views of one depth slot of the shared region
"""
