pub mod demo;
pub mod generate;
pub mod inspect;
pub mod redecode;
