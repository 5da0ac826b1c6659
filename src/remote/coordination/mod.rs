//! Coordination without conditional PUT: push and collection locks with
//! their grace period (`locks`), the claim of a prefix by one store's
//! run (`owner`), the collection mark (`mark`) and what a remote
//! remembers under it (`known`).

pub(crate) mod known;
pub(crate) mod locks;
pub(crate) mod mark;
pub(crate) mod owner;
