//! `rl-node demo`: a real, small RL loop out of the box (built in the demo module).

use clap::Args;

#[derive(Args, Debug)]
pub struct DemoArgs {}

#[derive(Args, Debug)]
pub struct ToyArgs {
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub args: Vec<String>,
}

pub fn demo_main(_args: DemoArgs) -> i32 {
    eprintln!("error: the demo is not built yet");
    crate::exit::FAILED
}

pub fn toy_main(_args: ToyArgs) -> i32 {
    eprintln!("error: the toy workload is not built yet");
    crate::exit::FAILED
}
