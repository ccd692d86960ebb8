pub mod bench;
pub mod demo;
#[cfg(feature = "iree")]
pub mod export;
pub mod generate;
pub mod inspect;
pub mod redecode;
