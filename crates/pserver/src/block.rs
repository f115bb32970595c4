//! Names of parameter blocks, shared by the placement, the store, its
//! errors and its checkpoints.

use serde::{Deserialize, Serialize};
use std::fmt;

/// A block of a parameter: parameter index (spec order) and block index
/// within the parameter. Orders by parameter, then block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct BlockId {
    /// Index of the parameter in the spec list.
    pub param: u32,
    /// Index of the block within the parameter.
    pub block: u32,
}

impl BlockId {
    /// Shorthand constructor.
    pub fn new(param: u32, block: u32) -> Self {
        Self { param, block }
    }
}

impl fmt::Display for BlockId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.param, self.block)
    }
}
