//! Prints NVRTC's log (ptxas `-v`) for one kernel source: `kernel_report gemv [DEFINE...]`.
fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let name = args.first().map(String::as_str).unwrap_or("gemv");
    let k = trellm_cuda::kernels::ALL
        .iter()
        .find(|k| k.name == name)
        .ok_or_else(|| anyhow::anyhow!("no kernel source {name}"))?;
    let c = trellm_cuda::nvrtc::compile(k, &args[1.min(args.len())..], "sm_90a", true)?;
    println!("{}", c.log);
    Ok(())
}
