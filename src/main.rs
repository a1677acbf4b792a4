fn main() {
    std::process::exit(rl_node::cli::main());
}
