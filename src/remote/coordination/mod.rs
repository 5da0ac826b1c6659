//! Coordination without conditional PUT: push and collection locks with
//! their grace period (`locks`), and the claim of a prefix by one store's
//! run (`owner`).

pub(crate) mod locks;
pub(crate) mod owner;
