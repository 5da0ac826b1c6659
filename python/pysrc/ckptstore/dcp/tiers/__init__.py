"""The node-local tier (`ckptstore.dcp.Tiers`): a node's directory and
records (`_layout`), the node's open stores and retention (`_node`), a
save's shard and copies (`_save`), a load from the tier (`_load`), the
upload (`_upload`), and `Tiers` (`_tiers`). `ckptstore.dcp` re-exports `Tiers`; nothing is re-exported
here."""
