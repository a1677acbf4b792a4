use clap::Args;
#[derive(Args, Debug)]
pub struct DemoArgs {
    #[arg(long)]
    pub nodes: Option<u32>,
    #[arg(long)]
    pub seed: Option<u64>,
    #[arg(long)]
    pub iterations: Option<u64>,
}
#[derive(Args, Debug)]
pub struct ToyArgs {
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub args: Vec<String>,
}
pub fn demo_main(a: DemoArgs) -> i32 {
    eprintln!("{a:?} {:?}", std::env::args().collect::<Vec<_>>());
    0
}
pub fn toy_main(a: ToyArgs) -> i32 {
    eprintln!("{a:?}");
    0
}
